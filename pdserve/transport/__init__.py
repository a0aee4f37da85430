"""KV data planes: how a prefill worker's KV bytes reach a decode worker's reserved blocks.

gRPC stays the control plane (PushKV's header, progress and commit, reservations, errors); the
bytes go one of three ways, chosen per (prefill, decode) pair (`base.choose_transport`):

    grpc      in PushKV's KVData chunks (prefill_svc/sender.py, decode_svc/receiver.py)
    cuda_ipc  the prefill worker maps the decode worker's pool by its CUDA IPC handle and copies
              its blocks straight into the reserved ones (`cuda_ipc.py`)
    nixl      NIXL agents (UCX: host memory, VRAM, RDMA across hosts) WRITE the blocks (`nixl.py`)

A data plane writes one-sided into the peer's memory, then PushKV announces the cells written
(KVWritten); the decode worker checks coverage exactly as for grpc slabs.
"""
