"""The "strata" logger's messages in a test: ``with LogLines() as log: ...; log.lines``.
A handler of one's own (so Strata adds none to stderr) and the logger at INFO while open."""

import logging


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        log = logging.getLogger("strata")
        self.level = log.level
        log.addHandler(self)
        log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        log = logging.getLogger("strata")
        log.removeHandler(self)
        log.setLevel(self.level)
