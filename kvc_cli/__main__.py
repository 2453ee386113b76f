"""``python -m kvc_cli``: the ``kvc`` command."""

from kvc_cli.cli import main

raise SystemExit(main())
