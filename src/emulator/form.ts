// application/x-www-form-urlencoded with Stripe's bracket nesting: `metadata[operation_id]=x`,
// `expand[]=a&expand[]=b`, `items[0][price]=p`.
export type FormValue = string | FormValue[] | { [key: string]: FormValue };

export function parseForm(body: string): Record<string, FormValue> {
  const root: Record<string, FormValue> = {};
  for (const [rawKey, value] of new URLSearchParams(body)) {
    const [head, ...rest] = rawKey.split('[');
    const path = [head!, ...rest.map((p) => p.replace(/\]$/, ''))];
    let node: Record<string, FormValue> | FormValue[] = root;
    path.forEach((segment, i) => {
      const last = i === path.length - 1;
      const container = node as Record<string, FormValue> & FormValue[];
      const key = segment === '' && Array.isArray(container) ? container.length : segment;
      if (last) {
        container[key as never] = value as never;
        return;
      }
      const nextIsArray = path[i + 1] === '' || /^\d+$/.test(path[i + 1]!);
      container[key as never] ??= (nextIsArray ? [] : {}) as never;
      node = container[key as never] as Record<string, FormValue> | FormValue[];
    });
  }
  return root;
}
