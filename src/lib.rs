pub mod events;
pub mod hashing;
pub mod index;
