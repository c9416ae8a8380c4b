"""The project's own errors: each names what is wrong and what to do about it.

Entry points (workflows.core.cli) print these as one line and exit non-zero, without a
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from eagle3.chat_template import TemplateError
from eagle3.schema import ConfigError
from storage.store import StoreError


class InputError(ValueError):
    """Bad input data (a prompt file, a corpus row): names the file, row and field."""


class MissingArtefact(ConfigError):
    """An upstream artefact is missing: names it and the stage that makes it."""


class ServingError(RuntimeError):
    """A serving engine could not serve a draft (it failed to start, died, or ran out of
    time): names the engine, the draft and how it ended, with the end of its log."""


class StageFailure(RuntimeError):
    """Work units of a stage failed (after their retries) while the rest finished and was
    kept: names the units, the first cause, where the details are and what to do (a rerun
    redoes only the failed ones)."""


USER_ERRORS = (ConfigError, TemplateError, StoreError, InputError, ServingError, StageFailure)
