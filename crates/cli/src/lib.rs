//! The library half of the `metrale-ple` command: input parsers that the
//! fuzz targets and tests use directly. The subcommands live in the binary.

pub mod parse;
