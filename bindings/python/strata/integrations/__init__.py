"""Strata with other libraries' training loops.

- ``strata.integrations.transformers``: ``StrataTrainer``, a ``transformers.Trainer`` that
  trains through a Strata engine (docs/huggingface.md). Importing it imports transformers;
  ``import strata`` does not.
"""
