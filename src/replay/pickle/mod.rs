//! A restricted unpickler for PyTorch memory snapshots.
//!
//! It builds only data: dicts, lists, tuples, strings, bytes, integers (up to 128 bits), floats,
//! booleans and None, from pickle protocols 2 to 5. Every opcode that could name a class or call
//! code (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, PERSID, ...) is refused with an
//! error naming it. Hostile input never panics and never makes it allocate much more than the
//! input's own size: lengths are checked against the bytes that remain before anything is
//! reserved, and shared (memoized) values are shared in the result, not copied.
//!
//! Opcodes build a [`Document`]: a flat arena of nodes that borrow their strings from the input
//! (so that memoized containers can still be filled after they were memoized, as pickle
//! requires). Read it in place through [`ValueRef`]s, which is what the snapshot reader does, or
//! turn it into an owned [`PickleValue`] tree ([`parse`]) in which every node is converted once
//! and shared through `Arc`.
//!
//! This file holds the values, the errors and the document; `opcodes` names the opcodes,
//! `parser` runs them, and `json` builds the same document from JSON.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// How deeply values may nest. Snapshots nest about 7 levels; the limit keeps conversion and
/// `Drop` from overflowing the call stack on hostile input (and catches self-referencing lists).
pub const MAX_DEPTH: usize = 256;

/// A value read from a pickle. Containers are shared: a memoized value that the pickle refers to
/// many times (a stack frame, a dict key) exists once.
#[derive(Debug, Clone, PartialEq)]
pub enum PickleValue {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(Arc<str>),
    Bytes(Arc<[u8]>),
    List(Arc<[PickleValue]>),
    Tuple(Arc<[PickleValue]>),
    /// Entries in pickle order. A key that appears twice keeps both entries; [`PickleValue::get`]
    /// returns the later one, as Python's dict would.
    Dict(Arc<[(PickleValue, PickleValue)]>),
}

impl PickleValue {
    /// The value under the string key `key` when `self` is a dict.
    pub fn get(&self, key: &str) -> Option<&PickleValue> {
        match self {
            PickleValue::Dict(entries) => entries
                .iter()
                .rev()
                .find(|(k, _)| matches!(k, PickleValue::Str(s) if &**s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            PickleValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i128> {
        match self {
            PickleValue::Int(i) => Some(*i),
            PickleValue::Bool(b) => Some(i128::from(*b)),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            PickleValue::Float(f) => Some(*f),
            PickleValue::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            PickleValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The items of a list or a tuple.
    pub fn as_seq(&self) -> Option<&[PickleValue]> {
        match self {
            PickleValue::List(items) | PickleValue::Tuple(items) => Some(items),
            _ => None,
        }
    }

    pub fn as_dict(&self) -> Option<&[(PickleValue, PickleValue)]> {
        match self {
            PickleValue::Dict(entries) => Some(entries),
            _ => None,
        }
    }

    /// Python's name for the value's type with an article ("an int", "a dict"), for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            PickleValue::None => "None",
            PickleValue::Bool(_) => "a bool",
            PickleValue::Int(_) => "an int",
            PickleValue::Float(_) => "a float",
            PickleValue::Str(_) => "a str",
            PickleValue::Bytes(_) => "bytes",
            PickleValue::List(_) => "a list",
            PickleValue::Tuple(_) => "a tuple",
            PickleValue::Dict(_) => "a dict",
        }
    }
}

/// Why a pickle was not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickleErrorKind {
    /// The input does not start with a PROTO opcode of protocol 2 or later.
    NotPickle,
    /// PROTO names a protocol this reader does not know.
    UnsupportedProtocol(u8),
    /// The input ends inside an opcode or before STOP.
    Truncated,
    /// An opcode that names a class or calls code; `what` is the class when it can be told.
    Refused {
        opcode: &'static str,
        what: Option<String>,
    },
    /// A valid opcode that this reader does not build (text forms of protocols 0 and 1, sets).
    Unsupported { opcode: &'static str },
    /// A byte that is no pickle opcode.
    UnknownOpcode(u8),
    /// An integer wider than 128 bits.
    IntTooLarge,
    /// Values nest deeper than [`MAX_DEPTH`] or refer to themselves.
    TooDeep,
    /// The opcodes do not fit together (stack underflow, missing MARK, unknown memo key, ...).
    Malformed(String),
}

/// A pickle that could not be read, with the byte offset of the opcode at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickleError {
    pub offset: usize,
    pub kind: PickleErrorKind,
}

impl fmt::Display for PickleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = self.offset;
        match &self.kind {
            PickleErrorKind::NotPickle => {
                f.write_str("not a pickle of protocol 2 to 5 (no PROTO opcode at the start)")
            }
            PickleErrorKind::UnsupportedProtocol(p) => {
                write!(f, "pickle protocol {p} is not supported (2 to 5 are)")
            }
            PickleErrorKind::Truncated => write!(f, "truncated: the pickle ends at byte {at}"),
            PickleErrorKind::Refused { opcode, what } => {
                write!(f, "refused opcode {opcode} at byte {at}")?;
                if let Some(what) = what {
                    write!(f, " (class {what})")?;
                }
                f.write_str(": only dicts, lists, tuples, strings, bytes, numbers, booleans and None are read")
            }
            PickleErrorKind::Unsupported { opcode } => {
                write!(f, "unsupported opcode {opcode} at byte {at}")
            }
            PickleErrorKind::UnknownOpcode(b) => write!(f, "unknown opcode 0x{b:02x} at byte {at}"),
            PickleErrorKind::IntTooLarge => {
                write!(f, "integer wider than 128 bits at byte {at}")
            }
            PickleErrorKind::TooDeep => write!(
                f,
                "values nest deeper than {MAX_DEPTH} levels or refer to themselves"
            ),
            PickleErrorKind::Malformed(what) => write!(f, "malformed pickle at byte {at}: {what}"),
        }
    }
}

impl std::error::Error for PickleError {}

/// Reads a pickle (protocol 2 to 5) that holds only plain data.
pub fn parse(bytes: &[u8]) -> Result<PickleValue, PickleError> {
    Document::parse(bytes)?.to_value()
}

type NodeId = u32;

enum Node<'a> {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(Cow<'a, str>),
    Bytes(&'a [u8]),
    List(Vec<NodeId>),
    Tuple(Vec<NodeId>),
    Dict(Vec<(NodeId, NodeId)>),
}

/// A parsed pickle as a flat arena of values that borrow their strings from the input; read it
/// through [`ValueRef`]s. Cheaper than [`PickleValue`] when only part of the data is wanted:
/// nothing is copied or reference-counted.
pub struct Document<'a> {
    nodes: Vec<Node<'a>>,
    root: NodeId,
}

/// A value inside a [`Document`].
#[derive(Clone, Copy)]
pub struct ValueRef<'d, 'a> {
    doc: &'d Document<'a>,
    id: NodeId,
}

impl<'d, 'a> ValueRef<'d, 'a> {
    fn node(self) -> &'d Node<'a> {
        &self.doc.nodes[self.id as usize]
    }

    fn at(self, id: NodeId) -> ValueRef<'d, 'a> {
        ValueRef { doc: self.doc, id }
    }

    /// The value under the string key `key` when this is a dict (the later of duplicates).
    pub fn get(self, key: &str) -> Option<ValueRef<'d, 'a>> {
        match self.node() {
            Node::Dict(entries) => entries
                .iter()
                .rev()
                .find(|&&(k, _)| self.at(k).as_str() == Some(key))
                .map(|&(_, v)| self.at(v)),
            _ => None,
        }
    }

    pub fn as_str(self) -> Option<&'d str> {
        match self.node() {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(self) -> Option<i128> {
        match self.node() {
            Node::Int(i) => Some(*i),
            Node::Bool(b) => Some(i128::from(*b)),
            _ => None,
        }
    }

    pub fn as_f64(self) -> Option<f64> {
        match self.node() {
            Node::Float(x) => Some(*x),
            Node::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    pub fn as_bool(self) -> Option<bool> {
        match self.node() {
            Node::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn is_none(self) -> bool {
        matches!(self.node(), Node::None)
    }

    /// The items of a list or a tuple.
    pub fn items(self) -> Option<impl ExactSizeIterator<Item = ValueRef<'d, 'a>>> {
        match self.node() {
            Node::List(items) | Node::Tuple(items) => Some(items.iter().map(move |&i| self.at(i))),
            _ => None,
        }
    }

    /// The entries of a dict, in pickle order.
    pub fn entries(
        self,
    ) -> Option<impl ExactSizeIterator<Item = (ValueRef<'d, 'a>, ValueRef<'d, 'a>)>> {
        match self.node() {
            Node::Dict(entries) => {
                Some(entries.iter().map(move |&(k, v)| (self.at(k), self.at(v))))
            }
            _ => None,
        }
    }

    pub fn is_dict(self) -> bool {
        matches!(self.node(), Node::Dict(_))
    }

    /// The type with an article ("an int", "a dict"), for messages.
    pub fn type_name(self) -> &'static str {
        match self.node() {
            Node::None => "None",
            Node::Bool(_) => "a bool",
            Node::Int(_) => "an int",
            Node::Float(_) => "a float",
            Node::Str(_) => "a str",
            Node::Bytes(_) => "bytes",
            Node::List(_) => "a list",
            Node::Tuple(_) => "a tuple",
            Node::Dict(_) => "a dict",
        }
    }

    /// This value as an owned [`PickleValue`].
    pub fn to_value(self) -> Result<PickleValue, PickleError> {
        let mut slots: Vec<Slot> = vec![Slot::Todo; self.doc.nodes.len()];
        Ok(self.doc.convert(self.id, 0, &mut slots)?.value)
    }
}

mod json;
mod opcodes;
mod parser;

impl<'a> Document<'a> {
    pub fn root(&self) -> ValueRef<'_, 'a> {
        ValueRef {
            doc: self,
            id: self.root,
        }
    }

    /// The whole document as an owned [`PickleValue`].
    pub fn to_value(&self) -> Result<PickleValue, PickleError> {
        self.root().to_value()
    }

    /// Converts node `id`, met `depth` levels below the root. A node met again (memoized, so
    /// shared) is converted once and shared; it brings its own height along, and the depth limit
    /// counts that too: a shallow chain of shared values could otherwise nest without bound. A
    /// node met again while it is still being converted holds itself: refused at once, so that
    /// the path being converted never holds a container twice (each level reserves room for its
    /// items, and a list holding itself N times would otherwise reserve N items 256 times).
    fn convert(
        &self,
        id: NodeId,
        depth: usize,
        slots: &mut [Slot],
    ) -> Result<Converted, PickleError> {
        let too_deep = PickleError {
            offset: 0,
            kind: PickleErrorKind::TooDeep,
        };
        match &slots[id as usize] {
            Slot::Done(done) if depth + done.height <= MAX_DEPTH => return Ok(done.clone()),
            Slot::Done(_) | Slot::InProgress => return Err(too_deep),
            Slot::Todo if depth >= MAX_DEPTH => return Err(too_deep),
            Slot::Todo => slots[id as usize] = Slot::InProgress,
        }
        let mut height = 1;
        let mut child = |id: NodeId, slots: &mut [Slot]| {
            let c = self.convert(id, depth + 1, slots)?;
            height = height.max(c.height + 1);
            Ok::<_, PickleError>(c.value)
        };
        let value = match &self.nodes[id as usize] {
            Node::None => PickleValue::None,
            Node::Bool(b) => PickleValue::Bool(*b),
            Node::Int(i) => PickleValue::Int(*i),
            Node::Float(x) => PickleValue::Float(*x),
            Node::Str(s) => PickleValue::Str(Arc::from(&**s)),
            Node::Bytes(b) => PickleValue::Bytes(Arc::from(*b)),
            Node::List(items) | Node::Tuple(items) => {
                let mut out = Vec::with_capacity(items.len());
                for &item in items {
                    out.push(child(item, slots)?);
                }
                if matches!(self.nodes[id as usize], Node::List(_)) {
                    PickleValue::List(Arc::from(out))
                } else {
                    PickleValue::Tuple(Arc::from(out))
                }
            }
            Node::Dict(entries) => {
                let mut out = Vec::with_capacity(entries.len());
                for &(k, v) in entries {
                    out.push((child(k, slots)?, child(v, slots)?));
                }
                PickleValue::Dict(Arc::from(out))
            }
        };
        let done = Converted { value, height };
        slots[id as usize] = Slot::Done(done.clone());
        Ok(done)
    }
}

/// Where the conversion of one node stands.
#[derive(Clone)]
enum Slot {
    Todo,
    /// On the path being converted now.
    InProgress,
    Done(Converted),
}

/// A converted node, kept for the next reference to it: the value and how many levels it nests
/// (1 for a scalar or an empty container).
#[derive(Clone)]
struct Converted {
    value: PickleValue,
    height: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(text: &str) -> PickleValue {
        PickleValue::Str(Arc::from(text))
    }

    #[test]
    fn reads_protocol_5_data() {
        // pickle.dumps({'a':[1,2**70,-3,(1,2)],'b':1.5,'c':None,'d':True,'e':b'xy','f':bytearray(b'z')}, protocol=5)
        let bytes = b"\x80\x05\x95T\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01\x8a\t\x00\x00\x00\x00\x00\x00\x00\x00@J\xfd\xff\xff\xffK\x01K\x02\x86\x94e\x8c\x01b\x94G?\xf8\x00\x00\x00\x00\x00\x00\x8c\x01c\x94N\x8c\x01d\x94\x88\x8c\x01e\x94C\x02xy\x94\x8c\x01f\x94\x96\x01\x00\x00\x00\x00\x00\x00\x00z\x94u.";
        let v = parse(bytes).unwrap();
        let a = v.get("a").unwrap().as_seq().unwrap();
        assert_eq!(a[0], PickleValue::Int(1));
        assert_eq!(a[1], PickleValue::Int(1 << 70));
        assert_eq!(a[2], PickleValue::Int(-3));
        assert_eq!(
            a[3],
            PickleValue::Tuple(Arc::from(vec![PickleValue::Int(1), PickleValue::Int(2)]))
        );
        assert_eq!(v.get("b"), Some(&PickleValue::Float(1.5)));
        assert_eq!(v.get("c"), Some(&PickleValue::None));
        assert_eq!(v.get("d"), Some(&PickleValue::Bool(true)));
        assert_eq!(v.get("e"), Some(&PickleValue::Bytes(Arc::from(&b"xy"[..]))));
        assert_eq!(v.get("f"), Some(&PickleValue::Bytes(Arc::from(&b"z"[..]))));
    }

    #[test]
    fn memoized_values_are_shared_and_filled_after_memoizing() {
        // x = {}; y = [x, x]; then x filled... pickle order: EMPTY_LIST MEMOIZE MARK
        // EMPTY_DICT MEMOIZE MARK 'k' 1 SETITEMS BINGET 1 APPENDS STOP
        let bytes = b"\x80\x04]\x94(}\x94(\x8c\x01kK\x01uh\x01e.";
        let v = parse(bytes).unwrap();
        let items = v.as_seq().unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!(items[0], items[1]);
        assert_eq!(items[1].get("k"), Some(&PickleValue::Int(1)));
    }

    #[test]
    fn later_duplicate_key_wins() {
        let bytes = b"\x80\x04}(\x8c\x01kK\x01\x8c\x01kK\x02u.";
        assert_eq!(parse(bytes).unwrap().get("k"), Some(&PickleValue::Int(2)));
    }

    #[test]
    fn refuses_classes_with_their_names() {
        // pickle.dumps(collections.OrderedDict(), protocol=4)
        let bytes = b"\x80\x04\x95\"\x00\x00\x00\x00\x00\x00\x00\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94.";
        let err = parse(bytes).unwrap_err();
        assert_eq!(
            err.kind,
            PickleErrorKind::Refused {
                opcode: "STACK_GLOBAL",
                what: Some("collections.OrderedDict".into())
            }
        );
        let bytes = b"\x80\x02cos\nsystem\n(\x8c\x02lstR.";
        let err = parse(bytes).unwrap_err();
        assert_eq!(
            err.kind,
            PickleErrorKind::Refused {
                opcode: "GLOBAL",
                what: Some("os.system".into())
            }
        );
        assert!(err.to_string().contains("GLOBAL"));
    }

    #[test]
    fn structural_errors_are_errors() {
        for bytes in [
            &b"\x80\x04e."[..],          // APPENDS without MARK
            b"\x80\x04(a.",              // APPEND on an empty current stack
            b"\x80\x04h\x05.",           // unknown memo key
            b"\x80\x04K\x01K\x02a.",     // APPEND to an int
            b"\x80\x04}(K\x01u.",        // odd SETITEMS
            b"\x80\x04.",                // STOP on an empty stack
            b"\x80\x01N.",               // protocol 1
            b"\x80\x04]\x94h\x00a\x94.", // a list that holds itself
        ] {
            assert!(parse(bytes).is_err(), "{bytes:?}");
        }
        assert_eq!(parse(b"N.").unwrap_err().kind, PickleErrorKind::NotPickle);
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let mut bytes = b"\x80\x04".to_vec();
        bytes.extend(std::iter::repeat_n(b']', 100_000));
        bytes.extend(std::iter::repeat_n(b'a', 99_999));
        bytes.push(b'.');
        assert_eq!(parse(&bytes).unwrap_err().kind, PickleErrorKind::TooDeep);
    }

    #[test]
    fn huge_lengths_are_truncation_not_allocation() {
        for bytes in [
            &b"\x80\x04X\xff\xff\xff\xff"[..],
            b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff",
            b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\x7fN.",
            b"\x80\x04\x8b\xff\xff\xff\x7f",
        ] {
            assert_eq!(parse(bytes).unwrap_err().kind, PickleErrorKind::Truncated);
        }
        assert_eq!(parse(b"\x80\x04X\x02\x00\x00\x00ab.").unwrap(), s("ab"));
    }
}
