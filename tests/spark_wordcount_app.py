"""The word-count example's handler (examples/spark_wordcount.py) as an App for ``kafkatx run``, on a cluster.

For test_spark_cluster's word-count test: the topics and the group are the test's (``WORDCOUNT_LINES``,
``WORDCOUNT_COUNTS``, ``WORDCOUNT_GROUP``), the Spark master is ``$KAFKATX_SPARK_MASTER`` (a ``spark://`` or
``sc://`` URL), and the batches are small, so that the input makes several transactions.
"""

from __future__ import annotations

import os

import kafkatx.spark
from examples.spark_wordcount import count_words
from kafkatx import App

app = App("spark-wordcount-cluster", group_id=os.environ["WORDCOUNT_GROUP"])
kafkatx.spark.configure(app)  # the master: $KAFKATX_SPARK_MASTER
app.spark_listener(
    os.environ["WORDCOUNT_LINES"],
    output=os.environ["WORDCOUNT_COUNTS"],
    max_attempts=3,
    max_batch_records=250,
    max_batch_ms=500,
)(count_words)
