"""`python -m torchplace` is the same as the `torchplace` command."""

from .cli import main

raise SystemExit(main())
