// What a view is: load() fetches its data (each refresh, every few seconds),
// render() turns it into DOM. The page is redrawn only when the data changed,
// so that what the user is doing (a selection, a form) survives a refresh.

export interface View<T> {
  /** the hash route: #/overview, #/timeline/STORE/SESSION... */
  name: string;
  load(args: string[]): Promise<T>;
  render(data: T, args: string[], refresh: () => void): Node;
  /** what the view keeps between two renders (its state), part of the change test */
  state?(): unknown;
}
