"""SGLang rollout servers: the server process, its HTTP client (an engine), where servers go
(placement), and how they are started: on this node, on every Ray node (one host actor each),
or by each torchrun node. Nothing here imports sglang; servers are other processes."""
