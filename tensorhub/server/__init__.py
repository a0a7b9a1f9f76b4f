"""The coordinator's inside (not public API: ``tensorhub.__all__`` and ``tensorhub.coordinator``
are): the state machine and its decisions (``state``, ``grants``, ``catalog``, ``registry``,
``manifest_refs``, ``stripes``, ``ahead``, ``views``, ``state_config``), its durable stores
(``store``, ``store_etcd``, ``election``), the service around them (``core``: lock, clock,
leadership; ``manifest_cache``, ``fleet``) and its HTTP application (``app``: the routes;
``asgi``: the shell below them). Started by ``tensorhub.coordinator``. Nothing here is
imported by a reader or a holder (``tensorhub.hub`` and what it uses)."""
