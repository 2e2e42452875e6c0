//! cuDNN (to come).
