"""ARK inside real transfer engines: steering connections an engine opens itself.

``ark.integrations.preload`` builds and drives the ``connect()`` interposer;
``ark.integrations.mooncake`` wraps Mooncake's ``TransferEngine`` so that each write
takes a lease from the local agent and its connections use ports of the leased path.
"""
