"""Cluster mode on Ray: the controller that puts an edge daemon on every node with the
``dsec_edge`` resource and runs the apiserver replicas (dsec.control.cluster.actors), the
registry-backed fleet view each replica routes and places by (dsec.control.cluster.view), and
``dsec cluster up/status/down`` (dsec.control.cluster.ops)."""
