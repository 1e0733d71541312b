"""The application: :class:`App` declares listeners and runs their containers.

``application`` is the App itself; ``config`` its client configuration
(bootstrap servers, instance id, librdkafka settings, transactional ids);
``startup`` the checks before the containers start; ``transactions`` the
producer-initiated ``app.transaction()``.
"""

from kafkatx.app.application import App, Transaction

__all__ = ["App", "Transaction"]
