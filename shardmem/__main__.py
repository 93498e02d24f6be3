from shardmem.cli import main

raise SystemExit(main())
