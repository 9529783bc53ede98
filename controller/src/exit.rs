//! Every code the controller exits with, in one place. `run` exits 0 after a clean stop
//! and 1 when a component failed (printed once by `main`).

/// Invalid configuration or arguments (EX_USAGE).
pub const USAGE: u8 = 64;
