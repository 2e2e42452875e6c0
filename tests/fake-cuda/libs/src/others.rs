//! cuFFT, cuSPARSE, cuSOLVER (to come).
