from offloadpp.cli.main import main

raise SystemExit(main())
