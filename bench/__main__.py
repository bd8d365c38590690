"""``python -m bench``: run W1, W2, W3 and W4, write bench/results/latest.json and
docs/performance.md (see ``python -m bench --help``); ``python -m bench startup``: the
start-up cost of ``import onceonly`` and ``onceonly --help`` (bench/startup.py);
``python -m bench console``: the console's page times with many runs (bench/console.py);
``python -m bench agent``: LangGraph checkpointers under a tool-calling agent
(bench/agent.py)."""

import sys

if sys.argv[1:2] == ["agent"]:
    from .agent import main as agent

    sys.exit(agent(sys.argv[2:]))
if sys.argv[1:2] == ["engines"]:
    from .engines import main as engines

    sys.exit(engines(sys.argv[2:]))
if sys.argv[1:2] == ["startup"]:
    from .startup import main as startup

    sys.exit(startup(sys.argv[2:]))
if sys.argv[1:2] == ["console"]:
    from .console import main as console

    sys.exit(console(sys.argv[2:]))

from .runner import main

sys.exit(main())
