//! The simulated GPU (being written).
