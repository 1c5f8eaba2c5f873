"""More than one process: a worker's place in the cluster (`cluster`) and the watchdog that ends
a worker whose peer is lost (`peer_watchdog`)."""
