"""An emulated Ethernet cluster on one machine, for measuring training on a slow network.

Each node is a network namespace; ranks inside one talk over its loopback (fast, like NVLink inside a
server), and ranks on different nodes cross a veth link into a bridge whose both directions are
shaped with a token bucket (``tc tbf``), like a server's Ethernet port. ``shardwire testbed
up/run/check/down`` builds it, runs torchrun jobs across it, measures its link and removes it.

Modules: ``spec`` (``Testbed``: names, addresses, rate, the state file), ``network`` (namespaces,
bridge and shaping through ``ip`` and ``tc``), ``job`` (one torchrun per node), ``node`` (that
torchrun, ending in one line), ``probe`` and ``check`` (link measurements), ``regime`` (the rate
of a GPU cluster's regime: ``--like``).
"""
