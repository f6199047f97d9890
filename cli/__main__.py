"""``python -m cli``: the ``compress`` command."""
from cli.main import main

raise SystemExit(main())
