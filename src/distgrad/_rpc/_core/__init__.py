"""The agent core: calls, serving, codec, call table, pools, statistics, the layer protocol."""
