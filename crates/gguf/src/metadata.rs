//! The metadata key-value store of a GGUF file, with typed getters that turn a missing key or a
//! value of the wrong type into an error naming the key.
//!
//! Integer getters accept any of the eight integer types as long as the value fits the requested
//! type: converters disagree on whether a count is written as u32, i32 or u64, and the value is
//! what matters. Float and array getters are strict where a conversion would hide a broken file
//! (tokenizer scores must be f32).

use std::collections::HashMap;

use crate::{Array, GgufError, Value};

/// Metadata in file order, with lookup by key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    /// An empty store.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Appends an entry; a key that is already present is a [`GgufError::DuplicateKey`], as it
    /// is in a file. Lets tests build metadata without writing a file.
    pub fn insert(&mut self, key: impl Into<String>, value: Value) -> Result<(), GgufError> {
        let key = key.into();
        if self.index.contains_key(&key) {
            return Err(GgufError::DuplicateKey { key });
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        Ok(())
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Entries in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_owned(),
        })
    }

    /// Looks `key` up and converts it with `convert`, mapping absence to `Ok(None)`.
    fn opt<'a, T>(
        &'a self,
        key: &str,
        convert: impl FnOnce(&'a Value) -> Result<T, GgufError>,
    ) -> Result<Option<T>, GgufError> {
        self.get(key).map(convert).transpose()
    }

    fn integer<T: TryFrom<i128>>(
        key: &str,
        value: &Value,
        expected: &'static str,
    ) -> Result<T, GgufError> {
        let wide = value
            .as_integer()
            .ok_or_else(|| wrong_type(key, expected, value))?;
        T::try_from(wide).map_err(|_| GgufError::OutOfRange {
            key: key.to_owned(),
            expected,
            value: wide,
        })
    }

    /// An integer value that fits u32.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        Self::integer(key, self.require(key)?, "u32")
    }
    /// Like [`Metadata::get_u32`], `Ok(None)` when absent.
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.opt(key, |v| Self::integer(key, v, "u32"))
    }

    /// An integer value that fits u64.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        Self::integer(key, self.require(key)?, "u64")
    }
    /// Like [`Metadata::get_u64`], `Ok(None)` when absent.
    pub fn get_u64_opt(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.opt(key, |v| Self::integer(key, v, "u64"))
    }

    /// An integer value that fits i32.
    pub fn get_i32(&self, key: &str) -> Result<i32, GgufError> {
        Self::integer(key, self.require(key)?, "i32")
    }
    /// Like [`Metadata::get_i32`], `Ok(None)` when absent.
    pub fn get_i32_opt(&self, key: &str) -> Result<Option<i32>, GgufError> {
        self.opt(key, |v| Self::integer(key, v, "i32"))
    }

    /// An integer value that fits usize.
    pub fn get_usize(&self, key: &str) -> Result<usize, GgufError> {
        Self::integer(key, self.require(key)?, "usize")
    }
    /// Like [`Metadata::get_usize`], `Ok(None)` when absent.
    pub fn get_usize_opt(&self, key: &str) -> Result<Option<usize>, GgufError> {
        self.opt(key, |v| Self::integer(key, v, "usize"))
    }

    fn bool_of(key: &str, value: &Value) -> Result<bool, GgufError> {
        match value {
            Value::Bool(b) => Ok(*b),
            other => Err(wrong_type(key, "bool", other)),
        }
    }
    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        Self::bool_of(key, self.require(key)?)
    }
    /// Like [`Metadata::get_bool`], `Ok(None)` when absent.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.opt(key, |v| Self::bool_of(key, v))
    }

    fn str_of<'a>(key: &str, value: &'a Value) -> Result<&'a str, GgufError> {
        match value {
            Value::String(s) => Ok(s),
            other => Err(wrong_type(key, "string", other)),
        }
    }
    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        Self::str_of(key, self.require(key)?)
    }
    /// Like [`Metadata::get_str`], `Ok(None)` when absent.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.opt(key, |v| Self::str_of(key, v))
    }

    fn f32_of(key: &str, value: &Value) -> Result<f32, GgufError> {
        match value {
            Value::F32(x) => Ok(*x),
            // f64 is narrowed: hyperparameters such as epsilons and rope bases are used as f32.
            Value::F64(x) => Ok(*x as f32),
            other => Err(wrong_type(key, "f32 or f64", other)),
        }
    }
    /// An f32 value, or an f64 value narrowed to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        Self::f32_of(key, self.require(key)?)
    }
    /// Like [`Metadata::get_f32`], `Ok(None)` when absent.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.opt(key, |v| Self::f32_of(key, v))
    }

    fn str_array_of<'a>(key: &str, value: &'a Value) -> Result<&'a [String], GgufError> {
        match value {
            Value::Array(Array::String(v)) => Ok(v),
            other => Err(wrong_type(key, "array of string", other)),
        }
    }
    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        Self::str_array_of(key, self.require(key)?)
    }
    /// Like [`Metadata::get_str_array`], `Ok(None)` when absent.
    pub fn get_str_array_opt(&self, key: &str) -> Result<Option<&[String]>, GgufError> {
        self.opt(key, |v| Self::str_array_of(key, v))
    }

    fn f32_array_of<'a>(key: &str, value: &'a Value) -> Result<&'a [f32], GgufError> {
        match value {
            Value::Array(Array::F32(v)) => Ok(v),
            other => Err(wrong_type(key, "array of f32", other)),
        }
    }
    /// An array of f32, with no conversion from other element types.
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], GgufError> {
        Self::f32_array_of(key, self.require(key)?)
    }
    /// Like [`Metadata::get_f32_array`], `Ok(None)` when absent.
    pub fn get_f32_array_opt(&self, key: &str) -> Result<Option<&[f32]>, GgufError> {
        self.opt(key, |v| Self::f32_array_of(key, v))
    }

    fn i32_array_of<'a>(key: &str, value: &'a Value) -> Result<&'a [i32], GgufError> {
        match value {
            Value::Array(Array::I32(v)) => Ok(v),
            other => Err(wrong_type(key, "array of i32", other)),
        }
    }
    /// An array of i32, with no conversion from other element types.
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], GgufError> {
        Self::i32_array_of(key, self.require(key)?)
    }
    /// Like [`Metadata::get_i32_array`], `Ok(None)` when absent.
    pub fn get_i32_array_opt(&self, key: &str) -> Result<Option<&[i32]>, GgufError> {
        self.opt(key, |v| Self::i32_array_of(key, v))
    }

    fn u32_array_lossless_of(key: &str, value: &Value) -> Result<Vec<u32>, GgufError> {
        const EXPECTED: &str = "array of integers that fit u32";
        let wide = match value {
            Value::Array(a) => a.integers(),
            _ => None,
        }
        .ok_or_else(|| wrong_type(key, EXPECTED, value))?;
        wide.map(|x| {
            u32::try_from(x).map_err(|_| GgufError::OutOfRange {
                key: key.to_owned(),
                expected: "u32",
                value: x,
            })
        })
        .collect()
    }
    /// An array of any integer type whose every element fits u32.
    pub fn get_u32_array_lossless(&self, key: &str) -> Result<Vec<u32>, GgufError> {
        Self::u32_array_lossless_of(key, self.require(key)?)
    }
    /// Like [`Metadata::get_u32_array_lossless`], `Ok(None)` when absent.
    pub fn get_u32_array_lossless_opt(&self, key: &str) -> Result<Option<Vec<u32>>, GgufError> {
        self.opt(key, |v| Self::u32_array_lossless_of(key, v))
    }

    /// A per-layer value such as a head count, which converters write either as one integer for
    /// every layer or as an array with one integer per layer. Returns `n_layers` values.
    pub fn get_u32_per_layer(&self, key: &str, n_layers: usize) -> Result<Vec<u32>, GgufError> {
        let value = self.require(key)?;
        if let Value::Array(_) = value {
            let per_layer = Self::u32_array_lossless_of(key, value)?;
            if per_layer.len() != n_layers {
                return Err(GgufError::PerLayerLength {
                    key: key.to_owned(),
                    expected: n_layers,
                    found: per_layer.len(),
                });
            }
            Ok(per_layer)
        } else {
            Ok(vec![Self::integer::<u32>(key, value, "u32")?; n_layers])
        }
    }

    /// Checks that the arrays under `keys` have one length. Absent keys are skipped, so optional
    /// companions of a required array (tokenizer scores and token types next to the tokens) can be
    /// checked in one call; a present key that is not an array is a [`GgufError::WrongType`].
    pub fn check_same_len(&self, keys: &[&str]) -> Result<(), GgufError> {
        let mut lengths = Vec::with_capacity(keys.len());
        for &key in keys {
            match self.get(key) {
                None => {}
                Some(Value::Array(a)) => lengths.push((key.to_owned(), a.len())),
                Some(other) => return Err(wrong_type(key, "array", other)),
            }
        }
        if lengths.windows(2).any(|pair| pair[0].1 != pair[1].1) {
            return Err(GgufError::LengthMismatch { lengths });
        }
        Ok(())
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: found.type_name(),
    }
}
