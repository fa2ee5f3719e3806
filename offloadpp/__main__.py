from offloadpp.cli import main

raise SystemExit(main())
