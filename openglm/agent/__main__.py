from openglm.agent.cli import main

raise SystemExit(main())
