"""The ``kvsim`` program: the root group (``main``) and one module per subcommand.

This folder is installed as ``kvsim.cli``, not ``kvsim.sim.cli`` (pyproject's package-dir):
the command line sits above every part, so it may import traces, policies, sim, realexec and
reports, and none of them imports it. Its own helpers live here because only commands use
them: ``errors`` (a user's mistake is one line and exit 2), ``options`` (the run options
``simulate``, ``execute`` and ``validate`` share), ``aliases`` (options with old spellings).
"""
