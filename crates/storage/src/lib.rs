//! metrale-storage: the PLE n-gram table and its row cache.
//!
//! [`table`] is the interface the layer uses; the resident, mapped and
//! cached tables implement it.

pub mod table;
