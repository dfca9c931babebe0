"""Options with old spellings: kvsim's names that vLLM's now replace keep working for one release."""

from __future__ import annotations

import click


class AliasedOption(click.Option):
    """An option whose extra spellings (kvsim's old names) are accepted but not shown in --help."""

    def get_help_record(self, ctx: click.Context):
        shown, self.opts = self.opts, self.opts[:1]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = shown
