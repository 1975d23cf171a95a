from shardwire.cli import main

raise SystemExit(main())
