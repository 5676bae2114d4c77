"""What a group runs its tensor operations on (``base.Backend``, given to the group at creation):
aiodist's algorithms over the transport (``native``), device tensors staged through host buffers
around another backend (``staged``), torch's own process groups (``torch_engine``)."""
