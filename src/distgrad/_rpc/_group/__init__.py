"""The group: rendezvous, init and shutdown, dynamic membership, collectives."""
