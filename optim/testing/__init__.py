"""Harnesses for the tests and the benchmarks, not the library: several "hosts" in network namespaces
(``hosts``), a local etcd cluster (``etcd_cluster``) and the fault drill worker (``drill``)."""
