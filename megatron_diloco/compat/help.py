"""``--help`` on Megatron's parser: escape help strings that argparse cannot format.

argparse expands ``%(default)s``-style fields in every help string when it prints ``--help``; a bare
``%`` elsewhere raises ``ValueError`` and no help is printed at all. megatron-core 0.19.2 has one such
string (``--moe-paged-stash-buffer-size-factor-cuda``: "1.10 = 10%)"), so ``--help`` of any script on
its parser crashed. :func:`escape_unformattable_help` doubles the bare ``%`` of exactly the help strings
that fail to format, leaving the others (and their ``%(default)s`` fields) as they are.
"""

from __future__ import annotations

import argparse
import re


def escape_unformattable_help(parser: argparse.ArgumentParser) -> list[str]:
    """Make every help string of ``parser`` formattable; returns the options whose help was escaped."""
    formatter = parser._get_formatter()
    fixed = []
    for action in parser._actions:
        if not action.help or action.help is argparse.SUPPRESS:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            action.help = re.sub(r"%(?!\()", "%%", action.help.replace("%%", "\0")).replace("\0", "%%")
            fixed.append(action.option_strings[0] if action.option_strings else action.dest)
    return fixed
