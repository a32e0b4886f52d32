from jascl.cli import main

raise SystemExit(main())
