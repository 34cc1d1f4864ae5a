"""The process and its device: `onednn` / `openmp` (the CPU kernels' caches and thread pools),
`memory` (resident memory and glibc's heap, as the soak reads them), `transfer` (host <-> device copies)."""
