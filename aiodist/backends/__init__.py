"""What a group runs its tensor operations on besides aiodist's own algorithms: staging device
tensors through host buffers (``staged``), torch's own process groups (``torch_engine``), and the
hook that routes an operation of the async face to them (``dispatch``)."""
