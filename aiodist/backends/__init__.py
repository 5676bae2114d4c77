"""What a group runs its tensor operations on besides aiodist's own algorithms: staging device
tensors through host buffers (``staged``) and torch's own process groups (``torch_engine``)."""
