"""ARK inside real transfer engines: steering connections an engine opens itself.

``ark.integrations.preload`` builds and drives the ``connect()`` interposer;
``ark.integrations.mooncake`` wraps Mooncake's ``TransferEngine`` so that each write
takes a lease from the local agent and its connections use ports of the leased path.
``ark.integrations.verbs`` does the same for RoCEv2 queue pairs: its ``ibv_modify_qp``
interposer gives each QP the GRH flow label of a leased port when it connects.
"""
