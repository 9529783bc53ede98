#![allow(dead_code)]

pub use testkit::fake_gitea;
pub mod memory_driver;
