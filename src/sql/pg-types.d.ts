// pg-types declares its entry module only; src/sql/context.ts reads the built-in text parsers it registers.
declare module 'pg-types/lib/textParsers.js' {
  const textParsers: { init(register: (oid: number, parse: (text: string) => unknown) => void): void };
  export = textParsers;
}
