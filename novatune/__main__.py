from novatune.commands.cli import main

raise SystemExit(main())
