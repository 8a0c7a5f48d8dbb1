"""meshlet-init: the iptables rules that route a pod's TCP through its proxy."""
