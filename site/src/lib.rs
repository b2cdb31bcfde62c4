pub mod charts;
pub mod model;
