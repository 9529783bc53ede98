#![allow(dead_code)]

pub mod fake_gitea;
pub mod memory_driver;
