"""The server's log: one line per event, whatever a client sends or does.

Client strings reach the log only through the access log, escaped and clipped (service/errors.py,
`clip`), inside one JSON object a line. gRPC's own logger writes an eight-line traceback when an
answer cannot be sent because its client left or refused it (a message over the client's receive
limit); a client could repeat that at will, so it becomes one warning line.
"""

from __future__ import annotations

import logging
import re
import sys

__all__ = ["UnsentAnswer", "access", "configure"]

access = logging.getLogger("qkv.access")
_METHOD = re.compile(r"\[(/[\w./]+)\]")


class UnsentAnswer(logging.Filter):
    """grpc's ExecuteBatchError traceback (an answer its client never took) -> one warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[0] is not None and record.exc_info[0].__name__ == "ExecuteBatchError":
            method = _METHOD.search(record.getMessage())
            record.msg = "an answer on %s was not sent: its client left or refused it"
            record.args = (method.group(1) if method else "an RPC",)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def configure(level: str, access_log: bool) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("grpc._cython.cygrpc").addFilter(UnsentAnswer())
    if access_log:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)
        access.propagate = False
        access.setLevel(logging.INFO)
