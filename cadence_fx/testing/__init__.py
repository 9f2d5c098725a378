"""What the tests, the demo and the command line use beside the library: a CPU replay backend and a
small demo decoder with every state pattern of the real one. Not needed to serve a model."""
