"""The ``kafkatx`` command."""
import sys
def main(argv=None) -> int:
    print("kafkatx: not yet", file=sys.stderr)
    return 2
