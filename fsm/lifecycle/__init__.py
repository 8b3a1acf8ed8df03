"""The lifecycles as the spec declares them (``spec/lifecycle.toml``): the parsed spec
(:mod:`~kvtier.fsm.lifecycle.spec`), the names and state sets derived from it
(:mod:`~kvtier.fsm.lifecycle.names`), the guard registry
(:mod:`~kvtier.fsm.lifecycle.guards`) and the ``transitions`` machines built from it
(:mod:`~kvtier.fsm.lifecycle.machines`)."""
