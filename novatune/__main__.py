from novatune.cli import main

raise SystemExit(main())
