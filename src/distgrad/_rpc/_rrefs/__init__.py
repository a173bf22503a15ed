"""RRefs, a layer over the agent core: remote(), RRef, the owner and fork protocol, notices."""
