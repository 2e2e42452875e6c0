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

use rustc_hash::FxHashMap;
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

/// The opcodes, under their names in Python's `pickle` module.
mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const FLOAT: u8 = b'F';
    pub const INT: u8 = b'I';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const LONG: u8 = b'L';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const PERSID: u8 = b'P';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const STRING: u8 = b'S';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const UNICODE: u8 = b'V';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const DICT: u8 = b'd';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const GET: u8 = b'g';
    pub const BINGET: u8 = b'h';
    pub const INST: u8 = b'i';
    pub const LONG_BINGET: u8 = b'j';
    pub const LIST: u8 = b'l';
    pub const EMPTY_LIST: u8 = b']';
    pub const OBJ: u8 = b'o';
    pub const PUT: u8 = b'p';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const EXT1: u8 = 0x82;
    pub const EXT2: u8 = 0x83;
    pub const EXT4: u8 = 0x84;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const NEWOBJ_EX: u8 = 0x92;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
    pub const BYTEARRAY8: u8 = 0x96;
    pub const NEXT_BUFFER: u8 = 0x97;
    pub const READONLY_BUFFER: u8 = 0x98;
}

/// Opcodes that name classes or call code: refused.
fn refused_name(code: u8) -> Option<&'static str> {
    Some(match code {
        op::GLOBAL => "GLOBAL",
        op::STACK_GLOBAL => "STACK_GLOBAL",
        op::REDUCE => "REDUCE",
        op::BUILD => "BUILD",
        op::INST => "INST",
        op::OBJ => "OBJ",
        op::NEWOBJ => "NEWOBJ",
        op::NEWOBJ_EX => "NEWOBJ_EX",
        op::PERSID => "PERSID",
        op::BINPERSID => "BINPERSID",
        op::EXT1 => "EXT1",
        op::EXT2 => "EXT2",
        op::EXT4 => "EXT4",
        op::NEXT_BUFFER => "NEXT_BUFFER",
        op::READONLY_BUFFER => "READONLY_BUFFER",
        _ => return None,
    })
}

/// Valid opcodes that snapshots never use: the text forms of protocols 0 and 1, and sets.
fn unsupported_name(code: u8) -> Option<&'static str> {
    Some(match code {
        op::FLOAT => "FLOAT",
        op::INT => "INT",
        op::LONG => "LONG",
        op::STRING => "STRING",
        op::BINSTRING => "BINSTRING",
        op::SHORT_BINSTRING => "SHORT_BINSTRING",
        op::UNICODE => "UNICODE",
        op::GET => "GET",
        op::PUT => "PUT",
        op::EMPTY_SET => "EMPTY_SET",
        op::ADDITEMS => "ADDITEMS",
        op::FROZENSET => "FROZENSET",
        _ => return None,
    })
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    /// Where the opcode being read starts, for error messages.
    op_start: usize,
    nodes: Vec<Node<'a>>,
    stack: Vec<NodeId>,
    /// Stack heights at each open MARK; the items above the last one are the "current" stack.
    marks: Vec<usize>,
    /// Memo keys 0, 1, 2, ... as MEMOIZE assigns them.
    memo: Vec<NodeId>,
    /// Memo keys that BINPUT / LONG_BINPUT set out of order.
    memo_sparse: FxHashMap<u32, NodeId>,
}

impl<'a> Document<'a> {
    /// Reads a pickle (protocol 2 to 5) that holds only plain data.
    pub fn parse(input: &'a [u8]) -> Result<Document<'a>, PickleError> {
        if input.first() != Some(&op::PROTO) {
            return Err(PickleError {
                offset: 0,
                kind: PickleErrorKind::NotPickle,
            });
        }
        let mut parser = Parser {
            input,
            pos: 0,
            op_start: 0,
            // Snapshots hold roughly one node per 25 bytes; a guess, never a promise.
            nodes: Vec::with_capacity(input.len() / 25),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            memo_sparse: FxHashMap::default(),
        };
        let root = parser.run()?;
        Ok(Document {
            nodes: parser.nodes,
            root,
        })
    }

    /// The same structure from JSON: objects become dicts with string keys, arrays lists.
    pub fn from_json(value: &serde_json::Value) -> Document<'static> {
        let mut doc = Document {
            nodes: Vec::new(),
            root: 0,
        };
        doc.root = doc.push_json(value);
        doc
    }

    /// The same structure read straight from JSON text, without a `serde_json::Value` in
    /// between (which would cost several times the input): each value becomes its node as it
    /// is read. Nesting is limited by serde_json (128 levels); object keys keep their order,
    /// duplicates included.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Document<'static>, serde_json::Error> {
        use serde::de::DeserializeSeed;
        let mut doc = Document {
            nodes: Vec::new(),
            root: 0,
        };
        let mut deserializer = serde_json::Deserializer::from_slice(bytes);
        doc.root = JsonNode(&mut doc.nodes).deserialize(&mut deserializer)?;
        deserializer.end()?;
        Ok(doc)
    }

    fn push_json(&mut self, value: &serde_json::Value) -> NodeId {
        use serde_json::Value;
        let node = match value {
            Value::Null => Node::None,
            Value::Bool(b) => Node::Bool(*b),
            Value::Number(n) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => Node::Int(i128::from(i)),
                (None, Some(u)) => Node::Int(i128::from(u)),
                _ => Node::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
            Value::String(s) => Node::Str(Cow::Owned(s.clone())),
            Value::Array(items) => Node::List(items.iter().map(|v| self.push_json(v)).collect()),
            Value::Object(map) => Node::Dict(
                map.iter()
                    .map(|(k, v)| {
                        let key = self.push_json(&Value::String(k.clone()));
                        (key, self.push_json(v))
                    })
                    .collect(),
            ),
        };
        // serde_json nests at most 128 levels and its input bounds the node count.
        self.nodes.push(node);
        (self.nodes.len() - 1) as NodeId
    }

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

/// Reads one JSON value into the arena and gives its node (serde's seed for
/// [`Document::from_json_bytes`]).
struct JsonNode<'n>(&'n mut Vec<Node<'static>>);

impl JsonNode<'_> {
    fn push<E: serde::de::Error>(self, node: Node<'static>) -> Result<NodeId, E> {
        let id = NodeId::try_from(self.0.len())
            .map_err(|_| E::custom("more values than this reader can hold"))?;
        self.0.push(node);
        Ok(id)
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for JsonNode<'_> {
    type Value = NodeId;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<NodeId, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for JsonNode<'_> {
    type Value = NodeId;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<NodeId, E> {
        self.push(Node::None)
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<NodeId, E> {
        self.push(Node::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<NodeId, E> {
        self.push(Node::Int(i128::from(v)))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<NodeId, E> {
        self.push(Node::Int(i128::from(v)))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<NodeId, E> {
        self.push(Node::Float(v))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<NodeId, E> {
        self.push(Node::Str(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<NodeId, E> {
        self.push(Node::Str(Cow::Owned(v)))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<NodeId, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(JsonNode(self.0))? {
            items.push(item);
        }
        self.push(Node::List(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<NodeId, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let key = JsonNode(self.0).push(Node::Str(Cow::Owned(key)))?;
            let value = map.next_value_seed(JsonNode(self.0))?;
            entries.push((key, value));
        }
        self.push(Node::Dict(entries))
    }
}

impl<'a> Parser<'a> {
    fn error(&self, kind: PickleErrorKind) -> PickleError {
        PickleError {
            offset: self.op_start,
            kind,
        }
    }

    fn malformed(&self, what: impl Into<String>) -> PickleError {
        self.error(PickleErrorKind::Malformed(what.into()))
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], PickleError> {
        let remaining = (self.input.len() - self.pos) as u64;
        if n > remaining {
            return Err(PickleError {
                offset: self.input.len(),
                kind: PickleErrorKind::Truncated,
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.input[start..self.pos])
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let bytes = self.take(N as u64)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take_array::<1>()?[0])
    }

    fn u32_le(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.take_array()?))
    }

    fn u64_le(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.take_array()?))
    }

    fn push_node(&mut self, node: Node<'a>) -> Result<(), PickleError> {
        let id = NodeId::try_from(self.nodes.len())
            .map_err(|_| self.malformed("more values than this reader can hold"))?;
        self.nodes.push(node);
        self.stack.push(id);
        Ok(())
    }

    /// The height below which the current stack (above the last MARK) may not shrink.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<NodeId, PickleError> {
        if self.stack.len() <= self.floor() {
            return Err(self.malformed("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    fn top(&self) -> Result<NodeId, PickleError> {
        if self.stack.len() <= self.floor() {
            return Err(self.malformed("stack underflow"));
        }
        Ok(*self.stack.last().expect("checked above"))
    }

    /// Closes the last MARK and returns the stack height where its items start.
    fn pop_mark(&mut self) -> Result<usize, PickleError> {
        self.marks
            .pop()
            .ok_or_else(|| self.malformed("no MARK to close"))
    }

    fn memo_get(&self, key: u32) -> Result<NodeId, PickleError> {
        self.memo
            .get(key as usize)
            .or_else(|| self.memo_sparse.get(&key))
            .copied()
            .ok_or_else(|| self.malformed(format!("memo key {key} was never set")))
    }

    fn memo_put(&mut self, key: u32, id: NodeId) {
        if (key as usize) < self.memo.len() {
            self.memo[key as usize] = id;
        } else if key as usize == self.memo.len() && !self.memo_sparse.contains_key(&key) {
            self.memo.push(id);
        } else {
            self.memo_sparse.insert(key, id);
        }
    }

    fn container_items(&mut self, start: usize) -> Vec<NodeId> {
        self.stack.split_off(start)
    }

    fn push_int(&mut self, value: i128) -> Result<(), PickleError> {
        self.push_node(Node::Int(value))
    }

    fn push_long(&mut self, len: u64) -> Result<(), PickleError> {
        let bytes = self.take(len)?;
        let value = decode_long(bytes).ok_or_else(|| self.error(PickleErrorKind::IntTooLarge))?;
        self.push_int(value)
    }

    fn push_str(&mut self, len: u64) -> Result<(), PickleError> {
        let bytes = self.take(len)?;
        // Python writes str with 'surrogatepass'; lone surrogates become U+FFFD here.
        self.push_node(Node::Str(String::from_utf8_lossy(bytes)))
    }

    fn push_bytes(&mut self, len: u64) -> Result<(), PickleError> {
        let bytes = self.take(len)?;
        self.push_node(Node::Bytes(bytes))
    }

    fn push_tuple(&mut self, n: usize) -> Result<(), PickleError> {
        if self.stack.len() < self.floor() + n {
            return Err(self.malformed("stack underflow"));
        }
        let start = self.stack.len() - n;
        let items = self.container_items(start);
        self.push_node(Node::Tuple(items))
    }

    fn list_mut(&mut self, id: NodeId) -> Result<&mut Vec<NodeId>, PickleError> {
        match &mut self.nodes[id as usize] {
            Node::List(items) => Ok(items),
            _ => Err(PickleError {
                offset: self.op_start,
                kind: PickleErrorKind::Malformed("APPEND to a value that is no list".into()),
            }),
        }
    }

    fn dict_mut(&mut self, id: NodeId) -> Result<&mut Vec<(NodeId, NodeId)>, PickleError> {
        match &mut self.nodes[id as usize] {
            Node::Dict(entries) => Ok(entries),
            _ => Err(PickleError {
                offset: self.op_start,
                kind: PickleErrorKind::Malformed("SETITEM on a value that is no dict".into()),
            }),
        }
    }

    /// The class that GLOBAL / STACK_GLOBAL would load, for the refusal message.
    fn refused_class(&mut self, code: u8) -> Option<String> {
        let clean = |s: &str| -> String {
            s.chars()
                .take(80)
                .map(|c| if c.is_control() { '?' } else { c })
                .collect()
        };
        match code {
            op::GLOBAL | op::INST => {
                let rest = &self.input[self.pos..];
                let mut lines = rest.splitn(3, |&b| b == b'\n');
                let module = lines.next()?;
                let name = lines.next()?;
                Some(clean(&format!(
                    "{}.{}",
                    String::from_utf8_lossy(module),
                    String::from_utf8_lossy(name)
                )))
            }
            op::STACK_GLOBAL => {
                let n = self.stack.len();
                if n < 2 {
                    return None;
                }
                match (
                    &self.nodes[self.stack[n - 2] as usize],
                    &self.nodes[self.stack[n - 1] as usize],
                ) {
                    (Node::Str(module), Node::Str(name)) => {
                        Some(clean(&format!("{module}.{name}")))
                    }
                    _ => None,
                }
            }
            _ => None,
        }
    }

    fn run(&mut self) -> Result<NodeId, PickleError> {
        loop {
            self.op_start = self.pos;
            let code = self.u8()?;
            match code {
                op::PROTO => {
                    let version = self.u8()?;
                    if !(2..=5).contains(&version) {
                        return Err(self.error(PickleErrorKind::UnsupportedProtocol(version)));
                    }
                }
                op::FRAME => {
                    // Frames only group opcodes for buffered reading; the whole input is here.
                    let len = self.u64_le()?;
                    if len > (self.input.len() - self.pos) as u64 {
                        return Err(PickleError {
                            offset: self.input.len(),
                            kind: PickleErrorKind::Truncated,
                        });
                    }
                }
                op::STOP => {
                    return self.pop();
                }
                op::MARK => self.marks.push(self.stack.len()),
                op::POP => {
                    if self.stack.len() > self.floor() {
                        self.stack.pop();
                    } else {
                        // Python's POP on an empty current stack discards the MARK.
                        self.pop_mark()?;
                    }
                }
                op::POP_MARK => {
                    let start = self.pop_mark()?;
                    self.stack.truncate(start);
                }
                op::DUP => {
                    let top = self.top()?;
                    self.stack.push(top);
                }
                op::NONE => self.push_node(Node::None)?,
                op::NEWTRUE => self.push_node(Node::Bool(true))?,
                op::NEWFALSE => self.push_node(Node::Bool(false))?,
                op::BININT => {
                    let v = i32::from_le_bytes(self.take_array()?);
                    self.push_int(i128::from(v))?;
                }
                op::BININT1 => {
                    let v = self.u8()?;
                    self.push_int(i128::from(v))?;
                }
                op::BININT2 => {
                    let v = u16::from_le_bytes(self.take_array()?);
                    self.push_int(i128::from(v))?;
                }
                op::LONG1 => {
                    let len = self.u8()?;
                    self.push_long(u64::from(len))?;
                }
                op::LONG4 => {
                    let len = i32::from_le_bytes(self.take_array()?);
                    if len < 0 {
                        return Err(self.malformed("LONG4 with a negative length"));
                    }
                    self.push_long(len as u64)?;
                }
                op::BINFLOAT => {
                    let v = f64::from_be_bytes(self.take_array()?);
                    self.push_node(Node::Float(v))?;
                }
                op::SHORT_BINUNICODE => {
                    let len = self.u8()?;
                    self.push_str(u64::from(len))?;
                }
                op::BINUNICODE => {
                    let len = self.u32_le()?;
                    self.push_str(u64::from(len))?;
                }
                op::BINUNICODE8 => {
                    let len = self.u64_le()?;
                    self.push_str(len)?;
                }
                op::SHORT_BINBYTES => {
                    let len = self.u8()?;
                    self.push_bytes(u64::from(len))?;
                }
                op::BINBYTES => {
                    let len = self.u32_le()?;
                    self.push_bytes(u64::from(len))?;
                }
                op::BINBYTES8 | op::BYTEARRAY8 => {
                    let len = self.u64_le()?;
                    self.push_bytes(len)?;
                }
                op::EMPTY_DICT => self.push_node(Node::Dict(Vec::new()))?,
                op::EMPTY_LIST => self.push_node(Node::List(Vec::new()))?,
                op::EMPTY_TUPLE => self.push_node(Node::Tuple(Vec::new()))?,
                op::TUPLE => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    self.push_node(Node::Tuple(items))?;
                }
                op::TUPLE1 => self.push_tuple(1)?,
                op::TUPLE2 => self.push_tuple(2)?,
                op::TUPLE3 => self.push_tuple(3)?,
                op::LIST => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    self.push_node(Node::List(items))?;
                }
                op::DICT => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    let entries = pairs(&items).ok_or_else(|| {
                        self.malformed("DICT with an odd number of keys and values")
                    })?;
                    self.push_node(Node::Dict(entries))?;
                }
                op::APPEND => {
                    let value = self.pop()?;
                    let list = self.top()?;
                    self.list_mut(list)?.push(value);
                }
                op::APPENDS => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    let list = self.top()?;
                    self.list_mut(list)?.extend_from_slice(&items);
                }
                op::SETITEM => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let dict = self.top()?;
                    self.dict_mut(dict)?.push((key, value));
                }
                op::SETITEMS => {
                    let start = self.pop_mark()?;
                    let items = self.container_items(start);
                    let dict = self.top()?;
                    let entries = pairs(&items).ok_or_else(|| {
                        self.malformed("SETITEMS with an odd number of keys and values")
                    })?;
                    self.dict_mut(dict)?.extend_from_slice(&entries);
                }
                op::MEMOIZE => {
                    let top = self.top()?;
                    let key = u32::try_from(self.memo.len() + self.memo_sparse.len())
                        .map_err(|_| self.malformed("memo overflow"))?;
                    self.memo_put(key, top);
                }
                op::BINPUT => {
                    let key = self.u8()?;
                    let top = self.top()?;
                    self.memo_put(u32::from(key), top);
                }
                op::LONG_BINPUT => {
                    let key = self.u32_le()?;
                    let top = self.top()?;
                    self.memo_put(key, top);
                }
                op::BINGET => {
                    let key = self.u8()?;
                    let id = self.memo_get(u32::from(key))?;
                    self.stack.push(id);
                }
                op::LONG_BINGET => {
                    let key = self.u32_le()?;
                    let id = self.memo_get(key)?;
                    self.stack.push(id);
                }
                other => {
                    if let Some(opcode) = refused_name(other) {
                        let what = self.refused_class(other);
                        return Err(self.error(PickleErrorKind::Refused { opcode, what }));
                    }
                    if let Some(opcode) = unsupported_name(other) {
                        return Err(self.error(PickleErrorKind::Unsupported { opcode }));
                    }
                    return Err(self.error(PickleErrorKind::UnknownOpcode(other)));
                }
            }
        }
    }
}

fn pairs(items: &[NodeId]) -> Option<Vec<(NodeId, NodeId)>> {
    if !items.len().is_multiple_of(2) {
        return None;
    }
    Some(items.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect())
}

/// LONG1 / LONG4 payload: little-endian two's complement.
fn decode_long(bytes: &[u8]) -> Option<i128> {
    if bytes.len() > 16 {
        return None;
    }
    let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
    let mut buf = if negative { [0xff; 16] } else { [0; 16] };
    buf[..bytes.len()].copy_from_slice(bytes);
    Some(i128::from_le_bytes(buf))
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
    fn long_decoding() {
        assert_eq!(decode_long(&[]), Some(0));
        assert_eq!(decode_long(&[0xff]), Some(-1));
        assert_eq!(decode_long(&[0x00, 0x80]), Some(-32768));
        assert_eq!(decode_long(&[0xff, 0x00]), Some(255));
        assert_eq!(decode_long(&[0; 17]), None);
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
