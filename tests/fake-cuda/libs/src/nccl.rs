//! NCCL (to come).
